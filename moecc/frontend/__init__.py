"""Frontend: read a Hugging Face checkpoint directory and build moecc's graph.

`build.py` is the entry point (`build_graph`); `checkpoint.py` reads config and safetensors
headers, `config.py` checks the config and reads the model's facts, `tracer.py` traces each
decoder layer with torch.fx, `lowering.py` turns the traces into graph nodes, `roles.py`
says which modules are leaves and `weights.py` finds each weight in the checkpoint;
`families/` holds what is specific to each MoE family (one file each, and the registry)."""
