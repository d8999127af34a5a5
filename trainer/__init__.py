"""The JAX multi-host trainer run by every worker of a training segment (``python -m trainer``)."""
