import numpy as np
import numpy.typing as npt

def permutation(out: npt.NDArray[np.int64], seed: int, /) -> None: ...
