"""The public reports each rule of the catalog comes from (``Rule.cases``): for each case, up to four of its
issue or pull-request threads, as ``(label, address)``. The rule pages cite them under "Sources"."""

from __future__ import annotations

REPORTS: dict[int, tuple[tuple[str, str], ...]] = {
    1: (
        ('huggingface/transformers #23165', 'https://github.com/huggingface/transformers/issues/23165'),
        ('huggingface/accelerate #1778', 'https://github.com/huggingface/accelerate/issues/1778'),
        ('pytorch/pytorch #74739', 'https://github.com/pytorch/pytorch/issues/74739'),
        ('Facico/Chinese-Vicuna #168', 'https://github.com/Facico/Chinese-Vicuna/issues/168'),
    ),
    2: (
        ('huggingface/peft #1249', 'https://github.com/huggingface/peft/issues/1249'),
        ('huggingface/peft PR #1336', 'https://github.com/huggingface/peft/pull/1336'),
        ('huggingface/peft PR #1706', 'https://github.com/huggingface/peft/pull/1706'),
        ('haotian-liu/LLaVA #363', 'https://github.com/haotian-liu/LLaVA/issues/363'),
    ),
    3: (
        ('huggingface/diffusers #6086', 'https://github.com/huggingface/diffusers/issues/6086'),
        ('huggingface/diffusers PR #6119', 'https://github.com/huggingface/diffusers/pull/6119'),
    ),
    4: (
        ('huggingface/diffusers #5004', 'https://github.com/huggingface/diffusers/issues/5004'),
        ('huggingface/diffusers #6442', 'https://github.com/huggingface/diffusers/issues/6442'),
        ('huggingface/diffusers #6552', 'https://github.com/huggingface/diffusers/issues/6552'),
    ),
    5: (
        ('huggingface/diffusers #13124', 'https://github.com/huggingface/diffusers/issues/13124'),
        ('huggingface/diffusers PR #13895', 'https://github.com/huggingface/diffusers/pull/13895'),
    ),
    6: (
        ('huggingface/diffusers #1246', 'https://github.com/huggingface/diffusers/issues/1246'),
        ('huggingface/diffusers PR #1916', 'https://github.com/huggingface/diffusers/pull/1916'),
        ('ShivamShrirao/diffusers #131', 'https://github.com/ShivamShrirao/diffusers/issues/131'),
        ('brian6091/Dreambooth #7', 'https://github.com/brian6091/Dreambooth/issues/7'),
    ),
    7: (
        ('huggingface/diffusers #6363', 'https://github.com/huggingface/diffusers/issues/6363'),
    ),
    8: (
        ('huggingface/peft #341', 'https://github.com/huggingface/peft/issues/341'),
    ),
    9: (
        ('mk-minchul/AdaFace #127', 'https://github.com/mk-minchul/AdaFace/issues/127'),
        ('Lightning-AI/pytorch-lightning #7078', 'https://github.com/Lightning-AI/pytorch-lightning/issues/7078'),
    ),
    10: (
        ('Lightning-AI/pytorch-lightning #5140', 'https://github.com/Lightning-AI/pytorch-lightning/issues/5140'),
        ('Lightning-AI/litgpt #53', 'https://github.com/Lightning-AI/litgpt/issues/53'),
        ('Lightning-AI/litgpt #1252', 'https://github.com/Lightning-AI/litgpt/issues/1252'),
    ),
    11: (
        ('mark1879/Baichuan-13B-Finetuning #21', 'https://github.com/mark1879/Baichuan-13B-Finetuning/issues/21'),
        ('lyhue1991/torchkeras #91', 'https://github.com/lyhue1991/torchkeras/issues/91'),
        ('Facico/Chinese-Vicuna #168', 'https://github.com/Facico/Chinese-Vicuna/issues/168'),
        ('bmaltais/kohya_ss #3113', 'https://github.com/bmaltais/kohya_ss/issues/3113'),
    ),
    12: (
        ('pytorch/pytorch #127176', 'https://github.com/pytorch/pytorch/issues/127176'),
        ('QwenLM/Qwen-VL #372', 'https://github.com/QwenLM/Qwen-VL/issues/372'),
        ('InternLM/xtuner #960', 'https://github.com/InternLM/xtuner/issues/960'),
        ('h2oai/h2o-llmstudio #628', 'https://github.com/h2oai/h2o-llmstudio/issues/628'),
    ),
    13: (
        ('huggingface/trl PR #1644', 'https://github.com/huggingface/trl/pull/1644'),
        ('unslothai/unsloth PR #4005', 'https://github.com/unslothai/unsloth/pull/4005'),
    ),
    14: (
        ('JIA-Lab-research/ControlNeXt #64', 'https://github.com/JIA-Lab-research/ControlNeXt/issues/64'),
    ),
    15: (
        ('kohya-ss/sd-scripts #1914', 'https://github.com/kohya-ss/sd-scripts/issues/1914'),
        ('kohya-ss/sd-scripts #1707', 'https://github.com/kohya-ss/sd-scripts/issues/1707'),
        ('bmaltais/kohya_ss #2652', 'https://github.com/bmaltais/kohya_ss/issues/2652'),
    ),
    16: (
        ('huggingface/transformers #27212', 'https://github.com/huggingface/transformers/issues/27212'),
    ),
    17: (
        ('huggingface/accelerate #641', 'https://github.com/huggingface/accelerate/issues/641'),
        ('microsoft/Swin-Transformer #311', 'https://github.com/microsoft/Swin-Transformer/issues/311'),
        ('huggingface/diffusers #8960', 'https://github.com/huggingface/diffusers/issues/8960'),
        ('hiyouga/LlamaFactory #77', 'https://github.com/hiyouga/LlamaFactory/issues/77'),
    ),
    18: (
        ('huggingface/transformers #23905', 'https://github.com/huggingface/transformers/issues/23905'),
        ('huggingface/transformers #23935', 'https://github.com/huggingface/transformers/issues/23935'),
        ('pengxiao-song/LaWGPT #124', 'https://github.com/pengxiao-song/LaWGPT/issues/124'),
    ),
    19: (
        ('Haian-Jin/LVSM PR #19', 'https://github.com/Haian-Jin/LVSM/pull/19'),
        ('espnet/espnet PR #2362', 'https://github.com/espnet/espnet/pull/2362'),
    ),
    20: (
        ('HorizonRobotics/alf PR #1770', 'https://github.com/HorizonRobotics/alf/pull/1770'),
        ('Azure/MS-AMP PR #45', 'https://github.com/Azure/MS-AMP/pull/45'),
        ('neosr-project/neosr PR #9', 'https://github.com/neosr-project/neosr/pull/9'),
    ),
    21: (
        ('huggingface/accelerate #328', 'https://github.com/huggingface/accelerate/issues/328'),
        ('huggingface/blog #143', 'https://github.com/huggingface/blog/issues/143'),
        ('hiyouga/ChatGLM-Efficient-Tuning #34', 'https://github.com/hiyouga/ChatGLM-Efficient-Tuning/issues/34'),
        ('yoshitomo-matsubara/torchdistill #386', 'https://github.com/yoshitomo-matsubara/torchdistill/issues/386'),
    ),
    22: (
        ('Lightning-AI/pytorch-lightning #19695', 'https://github.com/Lightning-AI/pytorch-lightning/issues/19695'),
        ('facebookresearch/fairseq2 #1346', 'https://github.com/facebookresearch/fairseq2/issues/1346'),
    ),
    23: (
        ('pytorch/pytorch #44511', 'https://github.com/pytorch/pytorch/issues/44511'),
    ),
    24: (
        ('pytorch/pytorch #40907', 'https://github.com/pytorch/pytorch/issues/40907'),
        ('harubaru/waifu-diffusion #64', 'https://github.com/harubaru/waifu-diffusion/issues/64'),
    ),
    25: (
        ('huggingface/transformers #5651', 'https://github.com/huggingface/transformers/issues/5651'),
        ('google-research/text-to-text-transfer-transformer #539', 'https://github.com/google-research/text-to-text-transfer-transformer/issues/539'),
        ('declare-lab/flan-alpaca #19', 'https://github.com/declare-lab/flan-alpaca/issues/19'),
    ),
    26: (
        ('deepspeedai/DeepSpeedExamples #418', 'https://github.com/deepspeedai/DeepSpeedExamples/issues/418'),
        ('deepspeedai/DeepSpeed #4017', 'https://github.com/deepspeedai/DeepSpeed/issues/4017'),
        ('yangjianxin1/Firefly #68', 'https://github.com/yangjianxin1/Firefly/issues/68'),
        ('microsoft/LMOps #280', 'https://github.com/microsoft/LMOps/issues/280'),
    ),
    27: (
        ('facebookresearch/fairseq #512', 'https://github.com/facebookresearch/fairseq/issues/512'),
    ),
    28: (
        ('huggingface/transformers PR #17306', 'https://github.com/huggingface/transformers/pull/17306'),
        ('openai/gpt-2 PR #122', 'https://github.com/openai/gpt-2/pull/122'),
        ('google/flax #982', 'https://github.com/google/flax/issues/982'),
    ),
    29: (
        ('kohya-ss/sd-scripts #952', 'https://github.com/kohya-ss/sd-scripts/issues/952'),
        ('invoke-ai/invoke-training PR #58', 'https://github.com/invoke-ai/invoke-training/pull/58'),
        ('vladmandic/sdnext #374', 'https://github.com/vladmandic/sdnext/issues/374'),
    ),
    30: (
        ('pytorch/pytorch #46849', 'https://github.com/pytorch/pytorch/issues/46849'),
        ('facebookresearch/fairscale PR #263', 'https://github.com/facebookresearch/fairscale/pull/263'),
        ('huggingface/trl #6702', 'https://github.com/huggingface/trl/issues/6702'),
    ),
    31: (
        ('tloen/alpaca-lora #203', 'https://github.com/tloen/alpaca-lora/issues/203'),
        ('oobabooga/textgen #2119', 'https://github.com/oobabooga/textgen/issues/2119'),
        ('huggingface/trl #219', 'https://github.com/huggingface/trl/issues/219'),
    ),
    32: (
        ('huggingface/diffusers PR #6208', 'https://github.com/huggingface/diffusers/pull/6208'),
        ('huggingface/diffusers #9628', 'https://github.com/huggingface/diffusers/issues/9628'),
        ('mlfoundations/open_flamingo #260', 'https://github.com/mlfoundations/open_flamingo/issues/260'),
        ('vladmandic/sdnext #1978', 'https://github.com/vladmandic/sdnext/issues/1978'),
    ),
    33: (
        ('facebookresearch/fairscale #754', 'https://github.com/facebookresearch/fairscale/issues/754'),
        ('facebookresearch/fairscale #834', 'https://github.com/facebookresearch/fairscale/issues/834'),
        ('pytorch/pytorch #64632', 'https://github.com/pytorch/pytorch/issues/64632'),
    ),
    34: (
        ('pytorch/pytorch #111650', 'https://github.com/pytorch/pytorch/issues/111650'),
        ('pytorch/pytorch #99174', 'https://github.com/pytorch/pytorch/issues/99174'),
    ),
    35: (
        ('huggingface/transformers PR #9139', 'https://github.com/huggingface/transformers/pull/9139'),
        ('huggingface/diffusers #2084', 'https://github.com/huggingface/diffusers/issues/2084'),
    ),
    36: (
        ('huggingface/transformers #34053', 'https://github.com/huggingface/transformers/issues/34053'),
        ('huggingface/accelerate #4289', 'https://github.com/huggingface/accelerate/issues/4289'),
        ('allenai/tango #154', 'https://github.com/allenai/tango/issues/154'),
        ('mosaicml/composer PR #1376', 'https://github.com/mosaicml/composer/pull/1376'),
    ),
    37: (
        ('pytorch/pytorch #35926', 'https://github.com/pytorch/pytorch/issues/35926'),
        ('pytorch/pytorch #111559', 'https://github.com/pytorch/pytorch/issues/111559'),
    ),
    38: (
        ('pytorch/pytorch #35810', 'https://github.com/pytorch/pytorch/issues/35810'),
        ('NVIDIA/apex #243', 'https://github.com/NVIDIA/apex/issues/243'),
    ),
    39: (
        ('pytorch/ao PR #1124', 'https://github.com/pytorch/ao/pull/1124'),
        ('pytorch/torchdistx PR #52', 'https://github.com/pytorch/torchdistx/pull/52'),
        ('pytorch/pytorch #120376', 'https://github.com/pytorch/pytorch/issues/120376'),
        ('kohya-ss/sd-scripts PR #2159', 'https://github.com/kohya-ss/sd-scripts/pull/2159'),
    ),
    40: (
        ('huggingface/accelerate PR #1036', 'https://github.com/huggingface/accelerate/pull/1036'),
        ('facebookresearch/multimodal PR #433', 'https://github.com/facebookresearch/multimodal/pull/433'),
        ('ecmwf/WeatherGenerator #874', 'https://github.com/ecmwf/WeatherGenerator/issues/874'),
        ('deepspeedai/DeepSpeed PR #3166', 'https://github.com/deepspeedai/DeepSpeed/pull/3166'),
    ),
}
