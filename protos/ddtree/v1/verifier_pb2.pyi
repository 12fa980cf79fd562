from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class DecodeParams(_message.Message):
    __slots__ = ("max_new_tokens", "budget", "topk", "eos_token_ids", "ignore_eos", "temperature", "top_p", "top_k", "seed")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    budget: int
    topk: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., budget: _Optional[int] = ..., topk: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "continue_session", "persistent", "params")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_SESSION_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    continue_session: bool
    persistent: bool
    params: DecodeParams
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., continue_session: _Optional[bool] = ..., persistent: _Optional[bool] = ..., params: _Optional[_Union[DecodeParams, _Mapping]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("accepted_length", "tree_size", "prefill_tokens")
    ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted_length: int
    tree_size: int
    prefill_tokens: int
    def __init__(self, accepted_length: _Optional[int] = ..., tree_size: _Optional[int] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "stats", "finish_reason", "usage")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    stats: StepStats
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "steps", "mean_accepted_length", "session_length")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    mean_accepted_length: float
    session_length: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., session_length: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("cancelled_running_turn",)
    CANCELLED_RUNNING_TURN_FIELD_NUMBER: _ClassVar[int]
    cancelled_running_turn: bool
    def __init__(self, cancelled_running_turn: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "block_size", "max_budget", "page_size", "kv_pages_total", "kv_pages_free", "max_sessions", "open_sessions", "running_sessions", "max_session_len", "transport", "drafter_address", "drafter_connected", "device", "dtype", "mla_kernel")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MLA_KERNEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    max_budget: int
    page_size: int
    kv_pages_total: int
    kv_pages_free: int
    max_sessions: int
    open_sessions: int
    running_sessions: int
    max_session_len: int
    transport: str
    drafter_address: str
    drafter_connected: bool
    device: str
    dtype: str
    mla_kernel: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., max_budget: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., max_sessions: _Optional[int] = ..., open_sessions: _Optional[int] = ..., running_sessions: _Optional[int] = ..., max_session_len: _Optional[int] = ..., transport: _Optional[str] = ..., drafter_address: _Optional[str] = ..., drafter_connected: _Optional[bool] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., mla_kernel: _Optional[str] = ...) -> None: ...
