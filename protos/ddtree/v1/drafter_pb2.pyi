from protos.ddtree.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftStreamRequest(_message.Message):
    __slots__ = ("open", "step", "release", "context", "keep_warm", "ahead_committed")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KEEP_WARM_FIELD_NUMBER: _ClassVar[int]
    AHEAD_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    open: OpenStream
    step: DraftStep
    release: ReleaseSessions
    context: SessionContext
    keep_warm: KeepWarm
    ahead_committed: AheadCommitted
    def __init__(self, open: _Optional[_Union[OpenStream, _Mapping]] = ..., step: _Optional[_Union[DraftStep, _Mapping]] = ..., release: _Optional[_Union[ReleaseSessions, _Mapping]] = ..., context: _Optional[_Union[SessionContext, _Mapping]] = ..., keep_warm: _Optional[_Union[KeepWarm, _Mapping]] = ..., ahead_committed: _Optional[_Union[AheadCommitted, _Mapping]] = ...) -> None: ...

class OpenStream(_message.Message):
    __slots__ = ("client_id", "regions", "control_socket", "request_event", "doorbell_region_id", "context_projection", "request_doorbell_region_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_EVENT_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_REGION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PROJECTION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DOORBELL_REGION_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    regions: _containers.RepeatedCompositeFieldContainer[SharedRegion]
    control_socket: str
    request_event: bytes
    doorbell_region_id: int
    context_projection: str
    request_doorbell_region_id: int
    def __init__(self, client_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[SharedRegion, _Mapping]]] = ..., control_socket: _Optional[str] = ..., request_event: _Optional[bytes] = ..., doorbell_region_id: _Optional[int] = ..., context_projection: _Optional[str] = ..., request_doorbell_region_id: _Optional[int] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("region_id", "nbytes", "shm_path", "cuda")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    nbytes: int
    shm_path: str
    cuda: CudaIpcHandle
    def __init__(self, region_id: _Optional[int] = ..., nbytes: _Optional[int] = ..., shm_path: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("step_id", "sessions", "response_region_id", "ctx_features", "doorbell_value", "trees_in_place", "ahead_values", "request_doorbell_value")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_REGION_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_VALUE_FIELD_NUMBER: _ClassVar[int]
    TREES_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_VALUES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DOORBELL_VALUE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionDraftRequest]
    response_region_id: int
    ctx_features: _common_pb2.Tensor
    doorbell_value: int
    trees_in_place: int
    ahead_values: _common_pb2.Tensor
    request_doorbell_value: int
    def __init__(self, step_id: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionDraftRequest, _Mapping]]] = ..., response_region_id: _Optional[int] = ..., ctx_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., doorbell_value: _Optional[int] = ..., trees_in_place: _Optional[int] = ..., ahead_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., request_doorbell_value: _Optional[int] = ...) -> None: ...

class AheadCommitted(_message.Message):
    __slots__ = ("step_id", "rows", "traceparents")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rows: _containers.RepeatedScalarFieldContainer[int]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., rows: _Optional[_Iterable[int]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionDraftRequest(_message.Message):
    __slots__ = ("session_id", "ctx_start", "ctx_features", "root_token", "root_pos", "budget", "topk", "traceparent", "ctx_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_START_FIELD_NUMBER: _ClassVar[int]
    CTX_FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROOT_POS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CTX_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ctx_start: int
    ctx_features: _common_pb2.Tensor
    root_token: int
    root_pos: int
    budget: int
    topk: int
    traceparent: str
    ctx_rows: int
    def __init__(self, session_id: _Optional[str] = ..., ctx_start: _Optional[int] = ..., ctx_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., root_token: _Optional[int] = ..., root_pos: _Optional[int] = ..., budget: _Optional[int] = ..., topk: _Optional[int] = ..., traceparent: _Optional[str] = ..., ctx_rows: _Optional[int] = ...) -> None: ...

class SessionContext(_message.Message):
    __slots__ = ("session_id", "ctx_start", "ctx_features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_START_FIELD_NUMBER: _ClassVar[int]
    CTX_FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ctx_start: int
    ctx_features: _common_pb2.Tensor
    def __init__(self, session_id: _Optional[str] = ..., ctx_start: _Optional[int] = ..., ctx_features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ReleaseSessions(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepWarm(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftStreamResponse(_message.Message):
    __slots__ = ("opened", "trees")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    opened: DrafterInfo
    trees: DraftTrees
    def __init__(self, opened: _Optional[_Union[DrafterInfo, _Mapping]] = ..., trees: _Optional[_Union[DraftTrees, _Mapping]] = ...) -> None: ...

class DraftTrees(_message.Message):
    __slots__ = ("step_id", "session_ids", "n_nodes", "tokens", "parent", "depth", "first_child", "next_sibling", "logw", "errors", "compute_us", "after_event", "doorbell_value", "in_place")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    N_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHILD_FIELD_NUMBER: _ClassVar[int]
    NEXT_SIBLING_FIELD_NUMBER: _ClassVar[int]
    LOGW_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_VALUE_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    n_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _common_pb2.Tensor
    parent: _common_pb2.Tensor
    depth: _common_pb2.Tensor
    first_child: _common_pb2.Tensor
    next_sibling: _common_pb2.Tensor
    logw: _common_pb2.Tensor
    errors: _containers.RepeatedCompositeFieldContainer[SessionError]
    compute_us: int
    after_event: bool
    doorbell_value: int
    in_place: bool
    def __init__(self, step_id: _Optional[int] = ..., session_ids: _Optional[_Iterable[str]] = ..., n_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., parent: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., depth: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., first_child: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., next_sibling: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logw: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., errors: _Optional[_Iterable[_Union[SessionError, _Mapping]]] = ..., compute_us: _Optional[int] = ..., after_event: _Optional[bool] = ..., doorbell_value: _Optional[int] = ..., in_place: _Optional[bool] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("session_id", "code", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    code: int
    message: str
    def __init__(self, session_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "block_size", "target_layer_ids", "target_hidden_size", "max_budget", "max_sessions", "active_sessions", "draft_window", "streams", "device", "dtype", "trees_event", "step_features", "trees_doorbell", "keep_warm", "trees_in_place", "context_projection", "hidden_size", "draft_ahead", "request_doorbell")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TREES_EVENT_FIELD_NUMBER: _ClassVar[int]
    STEP_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREES_DOORBELL_FIELD_NUMBER: _ClassVar[int]
    KEEP_WARM_FIELD_NUMBER: _ClassVar[int]
    TREES_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PROJECTION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DOORBELL_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    block_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    target_hidden_size: int
    max_budget: int
    max_sessions: int
    active_sessions: int
    draft_window: int
    streams: int
    device: str
    dtype: str
    trees_event: bytes
    step_features: bool
    trees_doorbell: bool
    keep_warm: bool
    trees_in_place: bool
    context_projection: str
    hidden_size: int
    draft_ahead: bool
    request_doorbell: bool
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., target_hidden_size: _Optional[int] = ..., max_budget: _Optional[int] = ..., max_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., draft_window: _Optional[int] = ..., streams: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., trees_event: _Optional[bytes] = ..., step_features: _Optional[bool] = ..., trees_doorbell: _Optional[bool] = ..., keep_warm: _Optional[bool] = ..., trees_in_place: _Optional[bool] = ..., context_projection: _Optional[str] = ..., hidden_size: _Optional[int] = ..., draft_ahead: _Optional[bool] = ..., request_doorbell: _Optional[bool] = ...) -> None: ...
