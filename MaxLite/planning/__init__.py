"""Sizing a pod job before booking it: candidate layouts, their compiled costs and predicted speed (plan.py)."""
