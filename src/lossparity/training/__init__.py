"""Reference trainer of lossparity: data pipeline, model driver and training loop."""
