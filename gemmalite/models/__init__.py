"""Model architectures: tensor contracts, configuration and graphs, one package per family."""
