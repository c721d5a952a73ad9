"""What a chaos run stands on: the launcher (torchrun), emulated hosts (network namespaces),
the fault-injecting storage proxy and the S3 servers started for a run."""
