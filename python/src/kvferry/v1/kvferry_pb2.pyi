from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_MODE_AUTO: _ClassVar[PolicyMode]
    POLICY_MODE_FETCH: _ClassVar[PolicyMode]
    POLICY_MODE_RECOMPUTE: _ClassVar[PolicyMode]

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_FETCH: _ClassVar[Action]
    ACTION_RECOMPUTE: _ClassVar[Action]
    ACTION_SPLIT: _ClassVar[Action]
    ACTION_ALREADY_LOCAL: _ClassVar[Action]
POLICY_MODE_AUTO: PolicyMode
POLICY_MODE_FETCH: PolicyMode
POLICY_MODE_RECOMPUTE: PolicyMode
ACTION_UNSPECIFIED: Action
ACTION_FETCH: Action
ACTION_RECOMPUTE: Action
ACTION_SPLIT: Action
ACTION_ALREADY_LOCAL: Action

class Policy(_message.Message):
    __slots__ = ("mode", "allow_split", "max_egress_bytes", "allow_hedge")
    MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPLIT_FIELD_NUMBER: _ClassVar[int]
    MAX_EGRESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_HEDGE_FIELD_NUMBER: _ClassVar[int]
    mode: PolicyMode
    allow_split: bool
    max_egress_bytes: int
    allow_hedge: bool
    def __init__(self, mode: _Optional[_Union[PolicyMode, str]] = ..., allow_split: _Optional[bool] = ..., max_egress_bytes: _Optional[int] = ..., allow_hedge: _Optional[bool] = ...) -> None: ...

class MigrateSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "model_id", "layout_fingerprint", "token_ids", "block_hashes", "source_region", "target_engine", "deadline_ms", "policy", "deadline_unix_ms", "source_regions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REGION_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REGIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    model_id: str
    layout_fingerprint: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    source_region: str
    target_engine: str
    deadline_ms: int
    policy: Policy
    deadline_unix_ms: int
    source_regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., layout_fingerprint: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., source_region: _Optional[str] = ..., target_engine: _Optional[str] = ..., deadline_ms: _Optional[int] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., source_regions: _Optional[_Iterable[str]] = ...) -> None: ...

class ResidencyRequest(_message.Message):
    __slots__ = ("tenant", "model_id", "layout_fingerprint", "token_ids", "block_hashes", "regions", "deadline_ms")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    layout_fingerprint: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    regions: _containers.RepeatedScalarFieldContainer[str]
    deadline_ms: int
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., layout_fingerprint: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., regions: _Optional[_Iterable[str]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class ResidencyResponse(_message.Message):
    __slots__ = ("region", "prefix_tokens", "holdings")
    REGION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    region: str
    prefix_tokens: int
    holdings: _containers.RepeatedCompositeFieldContainer[Holding]
    def __init__(self, region: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., holdings: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ...) -> None: ...

class Holding(_message.Message):
    __slots__ = ("region", "tokens", "reachable", "predicted_s", "note")
    REGION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    region: str
    tokens: int
    reachable: bool
    predicted_s: float
    note: str
    def __init__(self, region: _Optional[str] = ..., tokens: _Optional[int] = ..., reachable: _Optional[bool] = ..., predicted_s: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("action", "seconds", "gpu_seconds", "wire_bytes", "feasible", "kind", "sd_s", "calibration_samples", "late_probability", "late_delay_s")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SD_S_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LATE_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    LATE_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    action: str
    seconds: float
    gpu_seconds: float
    wire_bytes: float
    feasible: bool
    kind: Action
    sd_s: float
    calibration_samples: int
    late_probability: float
    late_delay_s: float
    def __init__(self, action: _Optional[str] = ..., seconds: _Optional[float] = ..., gpu_seconds: _Optional[float] = ..., wire_bytes: _Optional[float] = ..., feasible: _Optional[bool] = ..., kind: _Optional[_Union[Action, str]] = ..., sd_s: _Optional[float] = ..., calibration_samples: _Optional[int] = ..., late_probability: _Optional[float] = ..., late_delay_s: _Optional[float] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("action", "reason", "source_region", "source_tokens", "local_tokens", "split_recompute_tokens", "candidates", "crossover_tokens", "link", "recompute_s_per_token", "bytes_per_token", "kind", "hedge", "hedge_expected_s", "hedge_p_fetch_wins", "holdings", "load_s_per_token", "declined_split")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REGION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CROSSOVER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEDGE_FIELD_NUMBER: _ClassVar[int]
    HEDGE_EXPECTED_S_FIELD_NUMBER: _ClassVar[int]
    HEDGE_P_FETCH_WINS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECLINED_SPLIT_FIELD_NUMBER: _ClassVar[int]
    action: str
    reason: str
    source_region: str
    source_tokens: int
    local_tokens: int
    split_recompute_tokens: int
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    crossover_tokens: float
    link: LinkState
    recompute_s_per_token: float
    bytes_per_token: float
    kind: Action
    hedge: bool
    hedge_expected_s: float
    hedge_p_fetch_wins: float
    holdings: _containers.RepeatedCompositeFieldContainer[Holding]
    load_s_per_token: float
    declined_split: Candidate
    def __init__(self, action: _Optional[str] = ..., reason: _Optional[str] = ..., source_region: _Optional[str] = ..., source_tokens: _Optional[int] = ..., local_tokens: _Optional[int] = ..., split_recompute_tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., crossover_tokens: _Optional[float] = ..., link: _Optional[_Union[LinkState, _Mapping]] = ..., recompute_s_per_token: _Optional[float] = ..., bytes_per_token: _Optional[float] = ..., kind: _Optional[_Union[Action, str]] = ..., hedge: _Optional[bool] = ..., hedge_expected_s: _Optional[float] = ..., hedge_p_fetch_wins: _Optional[float] = ..., holdings: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ..., load_s_per_token: _Optional[float] = ..., declined_split: _Optional[_Union[Candidate, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "elapsed_s")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    elapsed_s: float
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("action", "tokens_ready", "bytes_moved", "wall_s", "goodput_gbps", "predicted_s", "measured_s", "path", "reconnects", "fallback", "first_layer_s", "kind", "hedged", "hedge_loser_s", "shared_fetch", "transport", "congestion", "split_compute_leg_s", "split_fetch_leg_s", "predicted_compute_leg_s", "predicted_fetch_leg_s")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_READY_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_GBPS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_S_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEDGED_FIELD_NUMBER: _ClassVar[int]
    HEDGE_LOSER_S_FIELD_NUMBER: _ClassVar[int]
    SHARED_FETCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CONGESTION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_COMPUTE_LEG_S_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FETCH_LEG_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COMPUTE_LEG_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FETCH_LEG_S_FIELD_NUMBER: _ClassVar[int]
    action: str
    tokens_ready: int
    bytes_moved: int
    wall_s: float
    goodput_gbps: float
    predicted_s: float
    measured_s: float
    path: str
    reconnects: int
    fallback: str
    first_layer_s: float
    kind: Action
    hedged: bool
    hedge_loser_s: float
    shared_fetch: bool
    transport: str
    congestion: str
    split_compute_leg_s: float
    split_fetch_leg_s: float
    predicted_compute_leg_s: float
    predicted_fetch_leg_s: float
    def __init__(self, action: _Optional[str] = ..., tokens_ready: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., wall_s: _Optional[float] = ..., goodput_gbps: _Optional[float] = ..., predicted_s: _Optional[float] = ..., measured_s: _Optional[float] = ..., path: _Optional[str] = ..., reconnects: _Optional[int] = ..., fallback: _Optional[str] = ..., first_layer_s: _Optional[float] = ..., kind: _Optional[_Union[Action, str]] = ..., hedged: _Optional[bool] = ..., hedge_loser_s: _Optional[float] = ..., shared_fetch: _Optional[bool] = ..., transport: _Optional[str] = ..., congestion: _Optional[str] = ..., split_compute_leg_s: _Optional[float] = ..., split_fetch_leg_s: _Optional[float] = ..., predicted_compute_leg_s: _Optional[float] = ..., predicted_fetch_leg_s: _Optional[float] = ...) -> None: ...

class MigrationEvent(_message.Message):
    __slots__ = ("decision", "progress", "receipt")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    progress: Progress
    receipt: Receipt
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ...) -> None: ...

class GetLinksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkState(_message.Message):
    __slots__ = ("region", "rtt_ms", "goodput_gbps", "age_s", "confidence", "fetch_utilization", "prediction_error", "connected", "samples", "fixed_ms", "fixed_sd_ms", "fixed_rtts", "calibrated_goodput_gbps", "per_byte_relative_sd", "fetch_noise", "calibration_samples", "transport_setting", "transport", "late_hazard_per_packet", "late_delay_rtts", "late_fraction")
    REGION_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_GBPS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    FETCH_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    FIXED_SD_MS_FIELD_NUMBER: _ClassVar[int]
    FIXED_RTTS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_GOODPUT_GBPS_FIELD_NUMBER: _ClassVar[int]
    PER_BYTE_RELATIVE_SD_FIELD_NUMBER: _ClassVar[int]
    FETCH_NOISE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_SETTING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LATE_HAZARD_PER_PACKET_FIELD_NUMBER: _ClassVar[int]
    LATE_DELAY_RTTS_FIELD_NUMBER: _ClassVar[int]
    LATE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    region: str
    rtt_ms: float
    goodput_gbps: float
    age_s: float
    confidence: float
    fetch_utilization: float
    prediction_error: float
    connected: bool
    samples: int
    fixed_ms: float
    fixed_sd_ms: float
    fixed_rtts: float
    calibrated_goodput_gbps: float
    per_byte_relative_sd: float
    fetch_noise: float
    calibration_samples: int
    transport_setting: str
    transport: str
    late_hazard_per_packet: float
    late_delay_rtts: float
    late_fraction: float
    def __init__(self, region: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., goodput_gbps: _Optional[float] = ..., age_s: _Optional[float] = ..., confidence: _Optional[float] = ..., fetch_utilization: _Optional[float] = ..., prediction_error: _Optional[float] = ..., connected: _Optional[bool] = ..., samples: _Optional[int] = ..., fixed_ms: _Optional[float] = ..., fixed_sd_ms: _Optional[float] = ..., fixed_rtts: _Optional[float] = ..., calibrated_goodput_gbps: _Optional[float] = ..., per_byte_relative_sd: _Optional[float] = ..., fetch_noise: _Optional[float] = ..., calibration_samples: _Optional[int] = ..., transport_setting: _Optional[str] = ..., transport: _Optional[str] = ..., late_hazard_per_packet: _Optional[float] = ..., late_delay_rtts: _Optional[float] = ..., late_fraction: _Optional[float] = ...) -> None: ...

class EngineCalibration(_message.Message):
    __slots__ = ("engine_id", "linear_s_per_token", "attention_s_per_pair", "fixed_s", "noise", "calibration_samples", "reported_linear_s_per_token", "reported_attention_s_per_pair", "load_factor", "split_interference", "split_samples", "hedge_interference", "hedge_samples", "load_s_per_byte", "load_samples", "split_scatter", "split_overhead_s", "reported_fixed_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAR_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_S_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REPORTED_LINEAR_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPORTED_ATTENTION_S_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SPLIT_INTERFERENCE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HEDGE_INTERFERENCE_FIELD_NUMBER: _ClassVar[int]
    HEDGE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SCATTER_FIELD_NUMBER: _ClassVar[int]
    SPLIT_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    linear_s_per_token: float
    attention_s_per_pair: float
    fixed_s: float
    noise: float
    calibration_samples: int
    reported_linear_s_per_token: float
    reported_attention_s_per_pair: float
    load_factor: float
    split_interference: float
    split_samples: int
    hedge_interference: float
    hedge_samples: int
    load_s_per_byte: float
    load_samples: int
    split_scatter: float
    split_overhead_s: float
    reported_fixed_s: float
    def __init__(self, engine_id: _Optional[str] = ..., linear_s_per_token: _Optional[float] = ..., attention_s_per_pair: _Optional[float] = ..., fixed_s: _Optional[float] = ..., noise: _Optional[float] = ..., calibration_samples: _Optional[int] = ..., reported_linear_s_per_token: _Optional[float] = ..., reported_attention_s_per_pair: _Optional[float] = ..., load_factor: _Optional[float] = ..., split_interference: _Optional[float] = ..., split_samples: _Optional[int] = ..., hedge_interference: _Optional[float] = ..., hedge_samples: _Optional[int] = ..., load_s_per_byte: _Optional[float] = ..., load_samples: _Optional[int] = ..., split_scatter: _Optional[float] = ..., split_overhead_s: _Optional[float] = ..., reported_fixed_s: _Optional[float] = ...) -> None: ...

class GetLinksResponse(_message.Message):
    __slots__ = ("region", "links", "engines")
    REGION_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    region: str
    links: _containers.RepeatedCompositeFieldContainer[LinkState]
    engines: _containers.RepeatedCompositeFieldContainer[EngineCalibration]
    def __init__(self, region: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkState, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineCalibration, _Mapping]]] = ...) -> None: ...

class PoolLayoutSpec(_message.Message):
    __slots__ = ("kind", "layers", "kv_heads", "head_dim", "block_size", "num_blocks", "dtype")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    def __init__(self, kind: _Optional[str] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ShmAccess(_message.Message):
    __slots__ = ("pool_token",)
    POOL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_token: str
    def __init__(self, pool_token: _Optional[str] = ...) -> None: ...

class NixlAccess(_message.Message):
    __slots__ = ("descriptor_json",)
    DESCRIPTOR_JSON_FIELD_NUMBER: _ClassVar[int]
    descriptor_json: bytes
    def __init__(self, descriptor_json: _Optional[bytes] = ...) -> None: ...

class CudaIpcAccess(_message.Message):
    __slots__ = ("descriptor_json",)
    DESCRIPTOR_JSON_FIELD_NUMBER: _ClassVar[int]
    descriptor_json: bytes
    def __init__(self, descriptor_json: _Optional[bytes] = ...) -> None: ...

class PrefillProfile(_message.Message):
    __slots__ = ("linear_s_per_token", "attention_s_per_pair", "samples", "fixed_s")
    LINEAR_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_S_PER_PAIR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    linear_s_per_token: float
    attention_s_per_pair: float
    samples: int
    fixed_s: float
    def __init__(self, linear_s_per_token: _Optional[float] = ..., attention_s_per_pair: _Optional[float] = ..., samples: _Optional[int] = ..., fixed_s: _Optional[float] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("engine_id", "model_id", "layout", "shm", "nixl", "cuda", "profile")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model_id: str
    layout: PoolLayoutSpec
    shm: ShmAccess
    nixl: NixlAccess
    cuda: CudaIpcAccess
    profile: PrefillProfile
    def __init__(self, engine_id: _Optional[str] = ..., model_id: _Optional[str] = ..., layout: _Optional[_Union[PoolLayoutSpec, _Mapping]] = ..., shm: _Optional[_Union[ShmAccess, _Mapping]] = ..., nixl: _Optional[_Union[NixlAccess, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcAccess, _Mapping]] = ..., profile: _Optional[_Union[PrefillProfile, _Mapping]] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("lease_id", "layout_fingerprint", "lease_ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    layout_fingerprint: bytes
    lease_ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., layout_fingerprint: _Optional[bytes] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("tenant", "block_hashes", "block_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("queue_depth", "utilization", "profile")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    utilization: float
    profile: PrefillProfile
    def __init__(self, queue_depth: _Optional[int] = ..., utilization: _Optional[float] = ..., profile: _Optional[_Union[PrefillProfile, _Mapping]] = ...) -> None: ...

class RecomputeDone(_message.Message):
    __slots__ = ("session_id", "tokens", "seconds", "error", "cancelled")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: int
    seconds: float
    error: str
    cancelled: bool
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class EngineEvent(_message.Message):
    __slots__ = ("lease_id", "stored", "removed", "load", "recompute_done")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_DONE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    stored: BlockStored
    removed: BlockRemoved
    load: LoadReport
    recompute_done: RecomputeDone
    def __init__(self, lease_id: _Optional[str] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., recompute_done: _Optional[_Union[RecomputeDone, _Mapping]] = ...) -> None: ...

class Recompute(_message.Message):
    __slots__ = ("session_id", "tenant", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictionHint(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CancelRecompute(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DaemonCommand(_message.Message):
    __slots__ = ("recompute", "evict", "cancel")
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    recompute: Recompute
    evict: EvictionHint
    cancel: CancelRecompute
    def __init__(self, recompute: _Optional[_Union[Recompute, _Mapping]] = ..., evict: _Optional[_Union[EvictionHint, _Mapping]] = ..., cancel: _Optional[_Union[CancelRecompute, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("lease_id", "tenant", "token_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("ready_tokens", "block_hashes", "in_engine")
    READY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    IN_ENGINE_FIELD_NUMBER: _ClassVar[int]
    ready_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    in_engine: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ready_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., in_engine: _Optional[_Iterable[bool]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("lease_id", "tenant", "block_hashes", "block_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    tenant: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., tenant: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("blocks_loaded",)
    BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    blocks_loaded: int
    def __init__(self, blocks_loaded: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "block_hashes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("lease_id", "stored", "removed_hashes", "removed_block_ids", "epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    stored: _containers.RepeatedCompositeFieldContainer[BlockStored]
    removed_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    removed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    def __init__(self, lease_id: _Optional[str] = ..., stored: _Optional[_Iterable[_Union[BlockStored, _Mapping]]] = ..., removed_hashes: _Optional[_Iterable[bytes]] = ..., removed_block_ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("stored", "removed", "stale")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    removed: int
    stale: int
    def __init__(self, stored: _Optional[int] = ..., removed: _Optional[int] = ..., stale: _Optional[int] = ...) -> None: ...

class PrefixRequest(_message.Message):
    __slots__ = ("tenant", "token_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixDigestResponse(_message.Message):
    __slots__ = ("tokens", "digest", "bytes", "loaded_tokens", "seconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    digest: bytes
    bytes: int
    loaded_tokens: int
    seconds: float
    def __init__(self, tokens: _Optional[int] = ..., digest: _Optional[bytes] = ..., bytes: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("tenant", "token_ids", "max_new_tokens", "use_cache")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USE_CACHE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    use_cache: bool
    def __init__(self, tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., use_cache: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("new_tokens", "loaded_tokens", "computed_tokens", "logits_digest", "prefill_s")
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    loaded_tokens: int
    computed_tokens: int
    logits_digest: bytes
    prefill_s: float
    def __init__(self, new_tokens: _Optional[_Iterable[int]] = ..., loaded_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., logits_digest: _Optional[bytes] = ..., prefill_s: _Optional[float] = ...) -> None: ...
