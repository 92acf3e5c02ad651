import pytest
import torch

from impl.common.api import ConfigError
from impl.swiftdiffusion import split_unet
from impl.swiftdiffusion.denoise import aggregate, controlnet_keep, denoise, run_controlnet
from impl.swiftdiffusion.models import check_cond, request_inputs


def _inputs(wl, bundle, n_cn=2):
    inp = request_inputs(wl, 1, n_cn, bundle)
    x = torch.cat([inp["noise"], inp["noise"]])
    emb = torch.cat([inp["uncond"], inp["cond"]])
    return inp, x, emb


@torch.no_grad()
def test_split_equals_full_forward_with_residuals(wl, bundle):
    inp, x, emb = _inputs(wl, bundle)
    cn = bundle.controlnets["cn-0"]
    t = torch.tensor(500)
    d, m = run_controlnet(cn, x, t, emb, torch.cat([inp["cn_images"][0]] * 2), 0.7)
    assert max(r.abs().max() for r in d) > 0  # the residuals are not the zero convs' zeros
    ref = bundle.unet(x, t, encoder_hidden_states=emb, down_block_additional_residuals=d,
                      mid_block_additional_residual=m, return_dict=False)[0]
    out = split_unet.split_forward(bundle.unet, x, t, emb, d, m)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = split_unet.split_forward(bundle.unet, x, t, emb)
    torch.testing.assert_close(plain, bundle.unet(x, t, encoder_hidden_states=emb).sample, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, out)  # residuals matter


@torch.no_grad()
def test_aggregation_equals_multicontrolnet(wl, bundle):
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    inp, x, emb = _inputs(wl, bundle)
    cns = [bundle.controlnets["cn-0"], bundle.controlnets["cn-1"]]
    imgs = [torch.cat([im] * 2) for im in inp["cn_images"]]
    scales = [0.5, 0.8]
    t = torch.tensor(300)
    multi = MultiControlNetModel(cns)
    rd, rm = multi(x, t, emb, controlnet_cond=imgs, conditioning_scale=scales, return_dict=False)
    d, m = aggregate([run_controlnet(cn, x, t, emb, im) for cn, im in zip(cns, imgs)], scales, "sum")
    for a, b in zip(d, rd):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-6)
    dm, mm = aggregate([run_controlnet(cn, x, t, emb, im) for cn, im in zip(cns, imgs)], scales, "katz_mean")
    torch.testing.assert_close(mm, (run_controlnet(cns[0], x, t, emb, imgs[0])[1]
                                    + run_controlnet(cns[1], x, t, emb, imgs[1])[1]) * 0.5 / 2)


def test_control_guidance_window_is_honoured(wl, bundle):
    assert [controlnet_keep(i, 10, 0.2, 0.7) for i in range(10)] == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    inp = request_inputs(wl, 2, 1, bundle)
    cn = [bundle.controlnets["cn-0"]]
    calls = []
    orig = cn[0].forward

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    cn[0].forward = spy
    try:
        denoise(bundle.unet, bundle.scheduler, inp, 6, 7.5, controlnets=cn, scales=[0.5], guidance_start=0.34,
                guidance_end=0.84)
    finally:
        del cn[0].forward
    assert len(calls) == sum(controlnet_keep(i, 6, 0.34, 0.84) for i in range(6)) == 2


def test_wrong_conditioning_size_is_one_line(wl, bundle):
    cn = bundle.controlnets["cn-0"]
    with pytest.raises(ConfigError, match=r"workload.cond_size: .*needs \(3, 32, 32\)"):
        check_cond(torch.zeros(1, 3, 64, 64), cn, (16, 16))
    state = split_unet.down(bundle.unet, torch.zeros(2, 4, 16, 16), torch.tensor(1), torch.zeros(2, 16, 32))
    with pytest.raises(ConfigError, match="controlnet residuals: 2 down residuals"):
        split_unet.mid_up(bundle.unet, state, [torch.zeros(1)] * 2, torch.zeros(1))
