"""Media types and annotation keys of a capsule (OCI image-spec 1.1 artifact)."""

from __future__ import annotations

ARTIFACT_TYPE = "application/vnd.sparkrun.coldsnap.capsule.v1"
CONFIG_MEDIA_TYPE = "application/vnd.sparkrun.coldsnap.capsule.config.v1+json"
LAYER_TAR = "application/vnd.sparkrun.coldsnap.images.v1.tar"
LAYER_TAR_ZSTD = "application/vnd.sparkrun.coldsnap.images.v1.tar+zstd"
# The tar compressed as independent zstd frames (their sizes in A_FRAMES), so a restore can
# decompress several at once; a reader that does not know frames refuses it by its type.
LAYER_TAR_ZSTD_FRAMES = "application/vnd.sparkrun.coldsnap.images.framed.v1.tar+zstd"
LAYER_TYPES = (LAYER_TAR, LAYER_TAR_ZSTD, LAYER_TAR_ZSTD_FRAMES)
# The engine's compile and JIT caches as the engine of a template capture left them (the n580
# driver): unpacked to the directory the capsule config names, never among a unit's images.
ENGINE_CACHE_TAR = "application/vnd.sparkrun.coldsnap.engine-caches.v1.tar"
ENGINE_CACHE_TAR_ZSTD_FRAMES = "application/vnd.sparkrun.coldsnap.engine-caches.framed.v1.tar+zstd"
ENGINE_CACHE_TYPES = (ENGINE_CACHE_TAR, ENGINE_CACHE_TAR_ZSTD_FRAMES)
FRAMED_TYPES = (LAYER_TAR_ZSTD_FRAMES, ENGINE_CACHE_TAR_ZSTD_FRAMES)

# Weights published as their own artifact (referenced from a capsule, never inside it).
WEIGHTS_ARTIFACT_TYPE = "application/vnd.sparkrun.coldsnap.weights.v1"
WEIGHTS_CONFIG_MEDIA_TYPE = "application/vnd.sparkrun.coldsnap.weights.config.v1+json"
WEIGHTS_FILE_MEDIA_TYPE = "application/vnd.sparkrun.coldsnap.weights.file.v1"

# A capsule's native weight payload (the engine's loaded tensors), published as an
# artifact whose subject is the capsule manifest it was written with.
NATIVE_ARTIFACT_TYPE = "application/vnd.sparkrun.coldsnap.native-weights.v1"
NATIVE_CONFIG_MEDIA_TYPE = "application/vnd.sparkrun.coldsnap.native-weights.config.v1+json"
NATIVE_FILE_MEDIA_TYPE = "application/vnd.sparkrun.coldsnap.native-weights.file.v1"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"

# Standard annotations (OCI image-spec annotations.md).
A_CREATED = "org.opencontainers.image.created"
A_TITLE = "org.opencontainers.image.title"
A_DESCRIPTION = "org.opencontainers.image.description"
A_VERSION = "org.opencontainers.image.version"
A_REF_NAME = "org.opencontainers.image.ref.name"
A_SOURCE = "org.opencontainers.image.source"
A_LICENSES = "org.opencontainers.image.licenses"

# Our own, reverse-DNS under the project's prefix.
PREFIX = "dev.sparkrun.coldsnap"
A_CAPSULE = PREFIX + ".capsule"
A_ENGINE = PREFIX + ".engine"
A_DRIVER = PREFIX + ".driver"
A_MODEL = PREFIX + ".model"
A_REQUEST = PREFIX + ".request"
A_UNIT = PREFIX + ".unit"
A_PART = PREFIX + ".part"
A_UNPACKED_SIZE = PREFIX + ".unpacked-size"
A_FRAMES = PREFIX + ".zstd-frames"  # comma-separated compressed sizes of the frames, in order
A_WEIGHTS = PREFIX + ".weights"
A_NATIVE = PREFIX + ".native-payload"
A_ENGINE_CACHES = PREFIX + ".engine-caches"  # comma-separated names of the caches the layer holds
