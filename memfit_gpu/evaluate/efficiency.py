"""The efficiency table of finished runs, any method (`memfit efficiency RUN_DIR...`, memfit_gpu/cli/efficiency.py).

One row per run directory, from what the run wrote:
- method and reader: config.yaml (`method` absent = memfit, a run from before methods existed);
- LLM calls and tokens at write time and at read time: ledger.json's roles summed per phase
  (readers.ROLE_PHASES: write = summary, mtm_summary, consolidate; read = answer, rewrite, rerank_slm; the
  judge is evaluation and left out). Calls are requests made (generated + served from the cache); tokens
  are the generated calls' (a resumed run's cache hits cost nothing again, so its tokens undercount; the
  `cached` column says how many);
- build time: timings.json `build` + `summaries` (the write-time stages of every method);
- per-question latency: (timings `retrieve` + the answer role's wall time, ledger.json roles.answer.wall_s: its
  calls and the answer loop's work between them, scoring included) / questions: the read path and the answer
  call, a mean over one batched pass, not a single question's latency.
  Not the answer stage's time: the judge runs beside the answers there (its time overlaps theirs), and a
  judge-audit or the pack depths add judge time that the answers never took;
- GPU-seconds of the write and read phases (local backends: wall time x GPUs held);
- estimated cost: the write and read tokens at a hosted model's list price (configs/prices.yaml,
  `--price-model`, as experiments/paper_tables.py prices its efficiency table), and the ledger's own USD
  (hosted models only; local backends cost 0 there): None when a hosted model the run called has no price,
  `unpriced_models` naming them (a total that left them out would read as the run's cost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memfit_gpu.files import read_json_object, read_yaml_mapping
from memfit_gpu.readers.ledger import Ledger, load_prices, read_ledger, recorded_cost

COLUMNS = ["run", "method", "reader", "questions", "write_calls", "read_calls", "write_input_tokens",
           "write_output_tokens", "read_input_tokens", "read_output_tokens", "cached", "build_s",
           "latency_s_per_question", "gpu_seconds", "ledger_usd", "unpriced_models", "est_usd"]
WRITE_STAGES = ("build", "summaries")
DEFAULT_PRICE_MODEL = "gpt-4.1-mini"


class EfficiencyError(FileNotFoundError):
    """A run directory that is not a finished run (the CLI prints it on one line, exit code 2)."""


def _json(path: Path, fields: dict[str, type | tuple[type, ...]] | None = None, numbers: bool = False,
          read: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """read_json_object of a file a finished run has (or `read`: read_ledger); DataError naming the file and the
    field when it is damaged."""
    if not path.is_file():
        raise EfficiencyError(f"{path} does not exist: {path.parent} is not a finished memfit run")
    return read(path) if read is not None else read_json_object(path, fields, numbers)


def efficiency_values(label: str, config: dict[str, Any], ledger_data: dict[str, Any], timings: dict[str, Any],
                      questions: int, price: dict[str, float] | None = None) -> dict[str, Any]:
    """One run's row (COLUMNS) from what it wrote: config.yaml, ledger.json, timings (stage seconds) and its
    number of questions. `price`: USD per 1M input/output tokens for est_usd (None leaves it empty)."""
    ledger = Ledger.from_dict(ledger_data)
    phases = ledger.phases()
    write, read = phases["write"], phases["read"]
    read_s = float(timings.get("retrieve", 0.0)) + ledger.roles["answer"].wall_s
    tokens_in = write.input_tokens + read.input_tokens
    tokens_out = write.output_tokens + read.output_tokens
    cost = recorded_cost(ledger_data)
    return {
        "run": label, "method": config.get("method", "memfit"), "reader": (config.get("reader") or {}).get("model"),
        "questions": questions,
        "write_calls": write.calls + write.cached, "read_calls": read.calls + read.cached,
        "write_input_tokens": write.input_tokens, "write_output_tokens": write.output_tokens,
        "read_input_tokens": read.input_tokens, "read_output_tokens": read.output_tokens,
        "cached": write.cached + read.cached,
        "build_s": round(sum(float(timings.get(stage, 0.0)) for stage in WRITE_STAGES), 3),
        "latency_s_per_question": round(read_s / questions, 4) if questions else None,
        "gpu_seconds": round(write.gpu_seconds + read.gpu_seconds, 3),
        "ledger_usd": cost["usd"],
        "unpriced_models": ", ".join(cost["unpriced_models"]) or None,
        "est_usd": None if price is None else round(tokens_in / 1e6 * price["input"]
                                                    + tokens_out / 1e6 * price["output"], 6),
    }


def efficiency_row(run_dir: str | Path, price: dict[str, float] | None = None) -> dict[str, Any]:
    """One run directory's row (COLUMNS), read from its files (see efficiency_values)."""
    run = Path(run_dir)
    if not (run / "DONE").is_file():
        raise EfficiencyError(f"{run} has no DONE: not a finished memfit run")
    if not (run / "config.yaml").is_file():
        raise EfficiencyError(f"{run / 'config.yaml'} is missing: not a memfit run directory")
    config = read_yaml_mapping(run / "config.yaml")
    metrics = _json(run / "metrics.json", {"questions": int})
    timings = _json(run / "timings.json", numbers=True)
    return efficiency_values(str(run), config, _json(run / "ledger.json", read=read_ledger), timings, metrics["questions"], price)


def efficiency_table(run_dirs: Sequence[str | Path], price_model: str | None = DEFAULT_PRICE_MODEL,
                     prices_path: str | Path | None = None) -> list[dict[str, Any]]:
    """Rows of every run, in the order given."""
    price = None
    if price_model is not None:
        prices = load_prices(prices_path)
        if price_model not in prices:
            raise EfficiencyError(f"no price for {price_model!r} in {prices_path or 'configs/prices.yaml'} "
                                  f"(have: {', '.join(sorted(prices))})")
        price = prices[price_model]
    return [efficiency_row(run, price) for run in run_dirs]
