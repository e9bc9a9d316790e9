/* FAKE libcuda.so.1 (tests only): the process checkpoint API's entry points, so a host without
 * the NVIDIA driver answers the plugin's support check ("does libcuda export
 * cuCheckpointProcessLock?") as a GPU host with driver >= 570 does. The checkpoint calls
 * themselves go through the fake bindings (cuda/bindings/driver.py); called here they fail
 * as a driver that was never initialized does. */
#define CUDA_ERROR_NOT_INITIALIZED 3

int cuCheckpointProcessLock(int pid, void *args) { (void)pid; (void)args; return CUDA_ERROR_NOT_INITIALIZED; }
int cuCheckpointProcessCheckpoint(int pid, void *args) { (void)pid; (void)args; return CUDA_ERROR_NOT_INITIALIZED; }
int cuCheckpointProcessRestore(int pid, void *args) { (void)pid; (void)args; return CUDA_ERROR_NOT_INITIALIZED; }
int cuCheckpointProcessUnlock(int pid, void *args) { (void)pid; (void)args; return CUDA_ERROR_NOT_INITIALIZED; }
int cuCheckpointProcessGetState(int pid, int *state) { (void)pid; (void)state; return CUDA_ERROR_NOT_INITIALIZED; }
