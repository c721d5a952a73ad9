"""``chaos tune``: the checkpoint interval from measured costs (DESIGN 4.5).

``model`` (Young, Daly, the exact optimum, scale projection), ``simulate`` (seeded failure
schedules, the recommendation, the plot) and ``measure`` (C, R and step time from a real run,
the confirming sweep). Importing this package does not import torch.
"""

from antifragile.chaos.tune.measure import (
    STOPPING_KINDS,
    Measured,
    costs_from_record,
    measure_costs,
    scenario_mtbf_s,
    sweep,
    sweep_every,
    with_kill,
)
from antifragile.chaos.tune.model import (
    DISTRIBUTIONS,
    META_MTTF_H,
    PROJECTION_GPUS,
    SIM_TOLERANCE,
    Costs,
    Distribution,
    MeasureError,
    TuneError,
    candidate_intervals,
    daly_interval,
    every_steps,
    expected_goodput,
    optimal_interval,
    project,
    young_interval,
)
from antifragile.chaos.tune.simulate import Curve, Tuning, plot, simulate, tune

__all__ = [
    "DISTRIBUTIONS", "META_MTTF_H", "PROJECTION_GPUS", "SIM_TOLERANCE", "STOPPING_KINDS",
    "Costs", "Curve", "Distribution", "MeasureError", "Measured", "TuneError", "Tuning",
    "candidate_intervals", "costs_from_record", "daly_interval", "every_steps",
    "expected_goodput", "measure_costs", "optimal_interval", "plot", "project",
    "scenario_mtbf_s", "simulate", "sweep", "sweep_every", "tune", "with_kill",
    "young_interval",
]
