from moecc_runtime.memory.copy_engine import *  # noqa: F401,F403  shim, removed by the lead
