"""The Megatron-Core backend: parallel state, models, HF conversion, optimiser and schedule, checkpoints, the `Learner`.

Submodules import megatron-core; import them directly (e.g.
`from trace_mega.learner.models import build_model`). On CPU, call
`trace_mega.learner.cpu_compat.enable_cpu_compat()` (done by
`parallel.init_parallel`) before building anything.
"""
