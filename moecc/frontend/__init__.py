"""Frontend: read a Hugging Face checkpoint directory and build moecc's graph."""
