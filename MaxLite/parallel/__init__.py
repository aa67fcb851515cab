"""Devices and shardings: the named mesh the config asks for, and logical axis names mapped onto it."""
