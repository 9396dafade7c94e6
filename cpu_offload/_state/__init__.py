"""State offload (offload="optimizer"): the optimizer state in host RAM between steps. Internal: no public names."""
