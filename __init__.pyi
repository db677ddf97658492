"""Types of the ``elastic`` facade, for type checkers (PEP 561 stub beside ``__init__.py``).

At runtime ``__init__.py`` resolves these names lazily (PEP 562) so that ``import
elastic`` stays cheap; a type checker reads this file instead and sees each name's real
type. ``X as X`` marks a re-export. tests/test_packaging.py checks that this list and
``_LAZY`` in ``__init__.py`` name the same objects.
"""

from elastic.api import ChildFailedError as ChildFailedError
from elastic.api import elastic_launch as elastic_launch
from elastic.api import launch_agent as launch_agent
from elastic.core.agent.loop import LocalElasticAgent as LocalElasticAgent
from elastic.core.interfaces.rendezvous import RendezvousError as RendezvousError
from elastic.core.interfaces.rendezvous import RendezvousHandler as RendezvousHandler
from elastic.core.interfaces.rendezvous import RendezvousParameters as RendezvousParameters
from elastic.core.interfaces.spec import RunResult as RunResult
from elastic.core.interfaces.spec import WorkerSpec as WorkerSpec
from elastic.core.interfaces.spec import WorkerState as WorkerState
from elastic.core.launch.config import LaunchConfig as LaunchConfig
from elastic.core.metrics import put_metric as put_metric
from elastic.core.plugin.config import ElasticConfig as ElasticConfig
from elastic.core.plugin.hookspecs import hookimpl as hookimpl
from elastic.core.rendezvous.registry import get_rendezvous_handler as get_rendezvous_handler
from elastic.core.rendezvous.registry import (
    register_rendezvous_handler as register_rendezvous_handler,
)
from elastic.plugins.errors.record import record as record
from elastic.training.dist import init_process_group as init_process_group
from elastic.training.heartbeat import heartbeat as heartbeat
from elastic.training.loop import train as train
from elastic.training.preemption import checkpoint_requested as checkpoint_requested
from elastic.training.preemption import checkpoint_saved as checkpoint_saved
from elastic.training.regroup import membership_changed as membership_changed
from elastic.training.regroup import regroup as regroup
from elastic.training.state import State as State
from elastic.training.tenure import tenured_rank as tenured_rank

__version__: str

def __dir__() -> list[str]: ...
