from chainspec.rpc.generated.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_FAILED_PRECONDITION: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_FAILED_PRECONDITION: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode

class DraftSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("seq_id", "start", "tokens", "hidden", "want_drafts", "sampling", "look_ahead", "verifying", "cache_key_ends", "cache_keys", "num_drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    WANT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOOK_AHEAD_FIELD_NUMBER: _ClassVar[int]
    VERIFYING_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_ENDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden: _tensor_pb2.Tensor
    want_drafts: bool
    sampling: DraftSampling
    look_ahead: bool
    verifying: _containers.RepeatedScalarFieldContainer[int]
    cache_key_ends: _containers.RepeatedScalarFieldContainer[int]
    cache_keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_drafts: int
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., want_drafts: _Optional[bool] = ..., sampling: _Optional[_Union[DraftSampling, _Mapping]] = ..., look_ahead: _Optional[bool] = ..., verifying: _Optional[_Iterable[int]] = ..., cache_key_ends: _Optional[_Iterable[int]] = ..., cache_keys: _Optional[_Iterable[bytes]] = ..., num_drafts: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("batch_id", "updates", "releases")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    updates: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    releases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., releases: _Optional[_Iterable[int]] = ...) -> None: ...

class Drafts(_message.Message):
    __slots__ = ("seq_id", "position", "tokens", "support", "probs", "draft_time_s")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    support: _tensor_pb2.Tensor
    probs: _tensor_pb2.Tensor
    draft_time_s: float
    def __init__(self, seq_id: _Optional[int] = ..., position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., support: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., draft_time_s: _Optional[float] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("seq_id", "code", "message", "expected_start")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_START_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    code: ErrorCode
    message: str
    expected_start: int
    def __init__(self, seq_id: _Optional[int] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., expected_start: _Optional[int] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("drafts", "error")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    drafts: Drafts
    error: SequenceError
    def __init__(self, drafts: _Optional[_Union[Drafts, _Mapping]] = ..., error: _Optional[_Union[SequenceError, _Mapping]] = ...) -> None: ...

class LookAhead(_message.Message):
    __slots__ = ("seq_id", "base", "outcome", "drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    base: int
    outcome: _containers.RepeatedScalarFieldContainer[int]
    drafts: Drafts
    def __init__(self, seq_id: _Optional[int] = ..., base: _Optional[int] = ..., outcome: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Union[Drafts, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("batch_id", "results", "ahead", "look_ahead")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOK_AHEAD_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    results: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    ahead: _containers.RepeatedCompositeFieldContainer[LookAhead]
    look_ahead: bool
    def __init__(self, batch_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., ahead: _Optional[_Iterable[_Union[LookAhead, _Mapping]]] = ..., look_ahead: _Optional[bool] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("model_name", "weights_fingerprint", "num_draft_tokens", "num_mtp_modules", "hidden_size", "vocab_size", "dtype", "chain", "capacity", "load", "version", "max_top_k", "max_message_bytes")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_MTP_MODULES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    weights_fingerprint: str
    num_draft_tokens: int
    num_mtp_modules: int
    hidden_size: int
    vocab_size: int
    dtype: str
    chain: bool
    capacity: int
    load: int
    version: str
    max_top_k: int
    max_message_bytes: int
    def __init__(self, model_name: _Optional[str] = ..., weights_fingerprint: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., num_mtp_modules: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., chain: _Optional[bool] = ..., capacity: _Optional[int] = ..., load: _Optional[int] = ..., version: _Optional[str] = ..., max_top_k: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...
