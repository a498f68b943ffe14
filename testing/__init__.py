"""Helpers for testing orchestrion and code built on it, as ``trio.testing`` is for trio.

Models and ensembles built in one line (`model`, `ensemble`, `step`, ...), checks that a
server is back at rest (`assert_idle`), a throwaway ``redis-server`` (`RedisServer`), a
Redis Cluster (`RedisClusterServers`) or Sentinels (`RedisSentinels`) of them,
``orchestrion serve`` in a child process (`start_server`) or both front ends inside a trio
program (`front_ends`), a look inside a running server's runtime (`inside`), and the mixed
load the reliability tests and benchmarks share. The project's tests and ``bench/`` use them;
nothing here imports pytest.
"""

from ._builders import StepRecorder as StepRecorder
from ._builders import assert_idle as assert_idle
from ._builders import cached as cached
from ._builders import chain as chain
from ._builders import decoupled as decoupled
from ._builders import double as double
from ._builders import ensemble as ensemble
from ._builders import fused as fused
from ._builders import gated as gated
from ._builders import infer_until_fused as infer_until_fused
from ._builders import infer_until_inline as infer_until_inline
from ._builders import model as model
from ._builders import outcome as outcome
from ._builders import plus_one as plus_one
from ._builders import settled as settled
from ._builders import step as step
from ._builders import tensor as tensor
from ._builders import triton_model as triton_model
from ._builders import with_fusion as with_fusion
from ._cache_contract import check_response_cache as check_response_cache
from ._front_ends import FRONTEND_VARIABLE as FRONTEND_VARIABLE
from ._front_ends import front_ends as front_ends
from ._front_ends import frontend_under_test as frontend_under_test
from ._inside import Inside as Inside
from ._inside import inside as inside
from ._mixed_load import at_rest as at_rest
from ._mixed_load import case as case
from ._mixed_load import check as check
from ._mixed_load import embedding_round as embedding_round
from ._mixed_load import grpc_inputs as grpc_inputs
from ._mixed_load import http_call as http_call
from ._netns import Hosts as Hosts
from ._netns import netns_unavailable as netns_unavailable
from ._redis import RedisServer as RedisServer
from ._redis import free_port as free_port
from ._redis import redis_binary as redis_binary
from ._redis_cluster import RedisClusterServers as RedisClusterServers
from ._redis_cluster import RedisSentinels as RedisSentinels
from ._replica_load import Outcome as Outcome
from ._replica_load import ReplicaLoad as ReplicaLoad
from ._replica_load import percentile as percentile
from ._replicas import ReplicaSite as ReplicaSite
from ._replicas import haproxy_unavailable as haproxy_unavailable
from ._served import Served as Served
from ._served import follow_output as follow_output
from ._served import get as get
from ._served import pending as pending
from ._served import post as post
from ._served import rss_kib as rss_kib
from ._served import serve_command as serve_command
from ._served import start_server as start_server
