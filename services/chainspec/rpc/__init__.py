"""The wire: protobuf stubs (`generated/`), the tensor codec and the message dataclasses.

Servicers and clients live here too; engines see only the dataclasses of `engine.draft_types`.
"""
