from moecc_runtime.worker.kernels import *  # noqa: F401,F403  shim, removed by the lead
