"""The replica side: the ModelServer deployment, one vLLM engine per replica."""
