"""trace_mega: a Megatron-scale trainer for agentic RL with TRACE-A allocation and TRACE-C credit."""

__version__ = "0.1.0"
