"""What a run will do before it runs: the step plan, batches, and the cost model (memory, speed, run length,
compile and recompute choices) that the training decides by and the doctor reads."""
