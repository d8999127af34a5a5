"""Argo workflow definitions (Hera) and the commands that build and run them."""
