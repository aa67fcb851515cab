"""Compiling ahead of time for a topology this machine does not have: the named targets, the compiled step, and
what its memory holds."""
