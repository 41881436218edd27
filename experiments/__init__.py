"""Experiment configs: each module has get_config(arg=None) -> ml_collections.ConfigDict."""
