// The vidattn C++ API (torch-free). Link vidattn::vidattn.
#pragma once

#include "vidattn/attention.h"
#include "vidattn/cuda_workspace.h"
#include "vidattn/error.h"
#include "vidattn/rope.h"
#include "vidattn/tensor_view.h"
#include "vidattn/version.h"
#include "vidattn/vsa.h"
#include "vidattn/vsa_combine.h"
