"""Running a graph plan: the scheduler (`GraphRun`, driver.py), recovery and live edits per branch (mend.py),
the step states (states.py) and the graph as data and text (view.py). See docs/graphs.md."""

from tether.agent.run.graph.driver import GraphRun
from tether.agent.run.graph.states import RESTART_UNKNOWN, RUNNING, Chooser

__all__ = ["RESTART_UNKNOWN", "RUNNING", "Chooser", "GraphRun"]
