"""The device plan (a package: sizes, node, workload, model_size, build, render): where each part of a run lives and how much host and GPU memory it takes, decided
from the configuration and a node description before anything loads.

    node = describe_node()                                   # this machine: visible GPUs, their memory, host RAM
    node = described_node(gpus=4, gpu_mem_gib=96, host_mem_gib=512)
    plan = make_plan(cfg, node)       # workload from the benchmark file, else the benchmark's published shape
    print(render(plan)); plan.check() # ConfigError naming the key to change when the run cannot fit
    run_cfg = plan.placed(cfg)        # index.device as the plan placed retrieval (what `memfit run` builds with)

Placement, as `memfit run` does it:
- vLLM engines (reader.backend=vllm): reader.instances groups of reader.tensor_parallel_size GPUs, the
  first visible GPUs in order (readers/vllm.py gpu_groups); each engine claims
  reader.gpu_memory_utilization of every GPU of its group, and vLLM refuses to start when less is free.
  A vLLM judge (eval.judge.backend=vllm) starts its own engines on the same GPUs: a second claim.
- Retrieval (bi-encoder and cross-encoder replicas, both BM25 indexes) with index.device=auto: on the GPUs
  the engines do not use when there are any; else on GPU 0 alone (one CUDA context beside the engines
  instead of one on every GPU); without GPUs on the CPU. An explicit index.device is kept as written.
- Dense indexes (episodes, summaries): GPU FAISS on GPU 0 when index.dense_device is auto or gpu, FAISS
  has GPU support and the node has a GPU (EpisodeStore passes DenseIndex no gpu_id), else the CPU. Each
  index owns a StandardGpuResources with its own temporary pool.
- transformers readers (reader, judge): in memfit's process on the first GPU (else the CPU), or spread
  over every GPU by accelerate with reader.device_map=auto.
- OpenAI-compatible servers are not memfit's: their memory is not counted (a server on this node is
  outside the plan: keep it off the GPUs memfit sees, e.g. CUDA_VISIBLE_DEVICES).

Fit: on every GPU, memfit's resident parts + the largest transient peak of one part + one CUDA context
for memfit's process + the engines' claims <= the GPU's memory; on the host, the resident parts + the
largest transient <= RAM (the cgroup limit when lower). On a node without GPUs only the host is checked.

Sizes are bytes per unit (the constants below, each with where it comes from) times the workload: from
the benchmark file when it is there (episodes, questions and texts counted; distinct BM25 terms from a
seeded sample of whole memories tokenised with index.tokenize), else from the benchmark's published shape
(data/synth.py shapes, turn length scaled to the published history length). Model sizes come from the
weights on disk (models.find_local: never a download), else from a small table of known models, else
they are "unknown" and said so loudly.
"""

from __future__ import annotations

from memfit_gpu.plan.build import Part, Plan, Problem, make_plan
from memfit_gpu.plan.model_size import ModelSize, model_size
from memfit_gpu.plan.node import Gpu, Node, describe_node, described_node
from memfit_gpu.plan.render import render
from memfit_gpu.plan.sizes import GIB, bm25_bytes, vector_bytes
from memfit_gpu.plan.workload import Workload, benchmark_workload, estimate_workload, workload_of

__all__ = ['GIB', 'Gpu', 'ModelSize', 'Node', 'Part', 'Plan', 'Problem', 'Workload', 'benchmark_workload', 'bm25_bytes', 'describe_node', 'described_node', 'estimate_workload', 'make_plan', 'model_size', 'render', 'vector_bytes', 'workload_of']
