# placeholder
class DistributedAttention: pass
