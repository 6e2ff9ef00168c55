"""Megatron-Core glue: model building, parallel state, vocab-parallel ops, the loss inside
the pipeline schedule, optimizer hooks, generation and checkpoints."""
