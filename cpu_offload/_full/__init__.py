"""Full offload (offload="full"): the optimizer, its protocol, host state, pipeline and validation. Internal: no public names."""
