"""Torch-level ops over the packed tree layout, each dispatching to its Triton kernel or reference
(`trace_mega.kernels`): the tree attention mask (`attention`) and the fused, vocab-parallel token
log-probs of the loss tokens (`logprobs`)."""
