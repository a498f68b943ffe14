"""``orchestrion tune`` (``orchestrion.tune(...)``): find the best configuration of a pipeline
on this machine.

What Triton's Model Analyzer does around Triton, in this process and in minutes: `tune` sweeps
the knobs orchestrion honours (instance counts, where executions run, dynamic batching,
``max_inflight_requests``, ensemble fusion), measures every candidate under a load made from
the configs (or from sample requests) at a range of concurrencies until stable, and writes a
report with plots and the best configuration as a ready model repository. The user's
repository is never changed. See docs/guide.md, "Tuning a pipeline".
"""

from ._knobs import KNOB_NAMES as KNOB_NAMES
from ._knobs import Knob as Knob
from ._measure import LoadSettings as LoadSettings
from ._measure import Point as Point
from ._search import CandidateResult as CandidateResult
from ._search import Constraints as Constraints
from ._search import Objective as Objective
from ._search import Status as Status
from ._tune import Progress as Progress
from ._tune import TuneResult as TuneResult
from ._tune import TuneSettings as TuneSettings
from ._tune import tune as tune
from ._tune import tune_async as tune_async
