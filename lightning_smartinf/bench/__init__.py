"""smartinf-bench: the systems compared and the worker that runs one of them."""
