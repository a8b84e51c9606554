"""Starting and supervising the workers: the launcher (`meshkit launch`), the worker bootstrap, CPU affinity."""
