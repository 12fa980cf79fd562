"""The user-facing front of DDTree Serve: gateway server, client SDK (`gateway.client`) and the `ddtree` CLI.

Kept import-light on purpose: `import gateway.client` must not import torch.
"""
