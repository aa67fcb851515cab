"""Training: the train state, the jitted step, the loop and what it writes (metrics, the run lock, preemption)."""
