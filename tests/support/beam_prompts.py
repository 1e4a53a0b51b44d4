"""Stand-in BEAM prompt files for tests (no network here, and ../shared does not ship BEAM's src/).

BEAM's real src/prompts.py and src/evaluation/compute_metrics.py come with `memfit data fetch beam`. These
small files have the same shape (the module-level strings and the `llm_equivalence` function memfit parses,
with the same slots) so that the machinery runs; they are a fault-free stand-in, and nothing scored with them
is a BEAM number.
"""

from __future__ import annotations

from pathlib import Path

PROMPTS = '''
unified_llm_judge_base_prompt = """
QUESTION: <question>
RUBRIC CRITERION: <rubric_item>
RESPONSE TO EVALUATE: <llm_response>
Reply {"score": 1.0, 0.5 or 0.0, "reason": "..."}
"""

answer_generation_for_rag = """
CONTEXT:
<context>

QUESTION:
<question>

RESPONSE:
"""
'''

METRICS = '''
def llm_equivalence(first_paragraph, second_paragraph, llm):
    system_msg = {"role": "system", "content": "Same event? Reply YES or NO."}
    user_msg = {"role": "user", "content": f"""First snippet: {first_paragraph} \\n
        Second snippet: {second_paragraph}"""}
    return "yes" in llm.invoke([system_msg, user_msg]).content.lower()
'''


def write_beam_prompts(beam_folder: Path) -> Path:
    """Write the stand-in src/prompts.py and src/evaluation/compute_metrics.py under `beam_folder`."""
    (beam_folder / "src" / "evaluation").mkdir(parents=True, exist_ok=True)
    (beam_folder / "src" / "prompts.py").write_text(PROMPTS)
    (beam_folder / "src" / "evaluation" / "compute_metrics.py").write_text(METRICS)
    return beam_folder
