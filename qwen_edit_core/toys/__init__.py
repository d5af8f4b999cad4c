"""The toy models: their construction (pretraining recipes, constructed VAEs) and the weights they build."""
