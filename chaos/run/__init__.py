"""``chaos run``: launch the trainer, inject the scenario's faults from outside, then measure,
judge against the fault-free reference and report (``pipeline.run``)."""
