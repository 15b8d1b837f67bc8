"""The one typed config spine: every option declared once (`sections.py`), read strictly
with one-line errors (`read.py`)."""

from chainspec.spine.read import ConfigError, DeprecatedKey, file_form, runtime_fields, validate
from chainspec.spine.sections import (
    DEMO_MODEL,
    GatewaySection,
    RoleSection,
    ServeSection,
    StackSection,
    default,
)

__all__ = ["DEMO_MODEL", "ConfigError", "DeprecatedKey", "GatewaySection", "RoleSection",
           "ServeSection", "StackSection", "default", "file_form", "runtime_fields",
           "validate"]
