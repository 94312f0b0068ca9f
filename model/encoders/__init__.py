"""What turns a user's prompt and images into what the DiT reads: the Qwen3-VL text encoder and its prompt
template, reference preparation, the Fun ControlNet's control latent, the conditioning, and the encode / decode
steps the nodes and the demo share."""
