"""The planner: the machine model (`hardware.py`), what a step costs read off the graph
(`costs.py`), the one cost model of a step (`cost_model.py`: job times, the step DAG of
`schedule.py`, predictions) and the integer program over it (`solve.py`)."""
