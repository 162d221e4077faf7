from moecc_runtime.job.exec import *  # noqa: F401,F403  shim, removed by the lead
