"""Training the diffusion view (distillation from the frozen AR view), its corpus and tokenizer builder.

Not needed for inference: ``orthrus`` never imports this package.
"""
