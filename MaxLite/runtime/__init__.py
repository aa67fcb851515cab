"""Starting a training process: the memory allocator, joining a multi-process job, and the checks before it runs."""
