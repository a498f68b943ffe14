"""Response caches: the `ResponseCache` interface, the ``local`` and ``redis`` caches, the
plugin lookup and the cache actor that owns a server's cache."""

from ._actor import CacheActor as CacheActor
from ._actor import Flight as Flight
from ._actor import open_cache_actor as open_cache_actor
from ._local import LocalCache as LocalCache
from ._local import open_local_cache as open_local_cache
from ._plugins import GROUP as GROUP
from ._plugins import available_caches as available_caches
from ._plugins import find_cache_factory as find_cache_factory
from ._plugins import open_cache as open_cache
from ._protocol import CacheFactory as CacheFactory
from ._protocol import CacheUsage as CacheUsage
from ._protocol import ResponseCache as ResponseCache
from ._redis import RedisCache as RedisCache
from ._redis import open_redis_cache as open_redis_cache
from ._redis_cluster import RedisClusterCache as RedisClusterCache
