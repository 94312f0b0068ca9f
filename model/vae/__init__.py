"""The RGBA VAE and the latent convention every other part of the model reads."""
