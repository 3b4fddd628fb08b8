"""Parallelism applied to built models from outside (see DESIGN.md, "Parallelism")."""
