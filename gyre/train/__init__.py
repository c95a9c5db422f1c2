"""`gyre train`: the single-machine RL loop (engine, proxy, harness runner, trajectories, GSPO)."""
