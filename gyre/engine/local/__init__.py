"""`gyre.engine.local`: a real CPU inference engine that speaks SGLang's native API (subset).

Imports torch and transformers; the client side (`gyre.engine`) does not.
"""

from gyre.engine.local.engine import TINY, LocalEngine, LocalEngineConfig
from gyre.engine.local.scheduler import SchedulerConfig
from gyre.engine.local.server import LocalEngineServer, build_app, serve

__all__ = ["TINY", "LocalEngine", "LocalEngineConfig", "LocalEngineServer", "SchedulerConfig", "build_app", "serve"]
